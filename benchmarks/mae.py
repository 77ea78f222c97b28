"""MAE training step vs transformers' ViTMAEForPreTraining at the same config.

Config (issue 5): 32x32 images, patch 4, width 192, 6 encoder layers, 3 heads, MLP 768, decoder
width 128 with 2 layers and 4 heads (MLP 512), mask ratio 0.75, batch 64, fp32, 2 threads, no
dropout. Both sides start from the same weights, see the same images and the same noise (so the
same patches are masked) and use torch's fused AdamW; each is timed in a process of its own.
"""

from __future__ import annotations

import torch

from benchmarks.common import Contenders, hf_peer, isolated, report, train_step
from tfcli.models.vit import MAEDecoder, ViT, ViTConfig
from tfcli.objectives.mae import loss as mae_loss

BATCH = 64
CONFIG = ViTConfig(
    image_size=32,
    patch_size=4,
    n_layer=6,
    n_head=3,
    d_model=192,
    d_ff=768,
    decoder_d_model=128,
    decoder_n_layer=2,
    decoder_n_head=4,
    decoder_d_ff=512,
    mask_ratio=0.75,
    dropout=0.0,
)


def peer_loss(peer, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """ViTMAEForPreTraining's loss; with the batch's noise (if any) the same patches are masked."""
    return peer(pixel_values=batch["pixels"], noise=batch.get("noise")).loss


def training() -> Contenders:
    torch.manual_seed(0)
    encoder, heads = ViT(CONFIG).train(), torch.nn.ModuleDict({"decoder": MAEDecoder(CONFIG)}).train()
    batch = {"pixels": torch.randn(BATCH, 3, 32, 32), "noise": torch.rand(BATCH, CONFIG.n_patches)}

    def tfcli():
        params = [p for p in [*encoder.parameters(), *heads.parameters()] if p.requires_grad]
        return train_step(lambda: mae_loss(encoder, heads, batch)[0], torch.optim.AdamW(params, lr=1e-4, fused=True))

    def transformers():
        import transformers

        peer = hf_peer(transformers.ViTMAEForPreTraining, encoder, heads.state_dict()).train()
        return train_step(
            lambda: peer_loss(peer, batch),
            torch.optim.AdamW([p for p in peer.parameters() if p.requires_grad], lr=1e-4, fused=True),
        )

    return {"tfcli": tfcli, "transformers": transformers}


def main() -> None:
    seconds = isolated("mae:training", ["tfcli", "transformers"], warmup=5, steps=15)
    report("mae train step (32px p4 d192 L6 h3 / dec d128 L2 h4, mask 0.75, b64, fp32)", "img", BATCH, seconds)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
