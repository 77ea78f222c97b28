"""Image classification on a ViT encoder: a linear head on the [CLS] vector or on the mean of the
patch vectors (no BatchNorm). `finetune.train: head` is a linear probe (frozen encoder), `all` full
finetuning. The encoder comes from a tfcli MAE run, a Hugging Face ViT/ViT-MAE directory, or a
fresh initialisation (the baseline a probe on a pretrained encoder must beat).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..adapters import method
from ..data.image_batches import ImageConfig, ImageSource, ImageTransform, check_images
from ..data.images import ImageSet, load_images
from ..data.labelled import balanced_sample
from ..display import phase
from ..errors import UserError
from ..models import kinds
from ..plugin import EvalOptions
from ..recipe import FinetuneConfig
from .classification import ClassificationTask, HeadSettings, TaskData
from .heads import ClassifierHead


@dataclass(frozen=True)
class ImageClassifyConfig(ImageConfig, HeadSettings):
    """The `image-classify:` recipe section: how images become pixels, and the head's settings."""

    def __post_init__(self):
        ImageConfig.__post_init__(self)
        HeadSettings.__post_init__(self)


class ImageClassify(ClassificationTask):
    key = "image-classify"
    model_kinds = (kinds.VISION_ENCODER, kinds.DECODER)  # a decoder: an ImageGPT run, reading colours
    recipe_pattern = "{family}-tiny-image-classify"
    Config = ImageClassifyConfig
    describe = "image classification"

    def load(
        self, recipe, backbone, data: str | None = None, labels: tuple[str, ...] = (), need_train: bool = True
    ) -> TaskData:
        """The images (data.source, or `data`); they must carry labels. Without a test split of their
        own a seeded data.val_fraction is held out."""
        source, ft = data or recipe.data.source, recipe.finetune or FinetuneConfig()
        with phase(f"reading images from {source}"):
            splits = load_images(source, recipe.data.val_fraction, recipe.train.seed)
        if splits.train.labels is None:
            raise UserError(
                f"{source}: images without labels; image-classify needs class sub-folders, "
                f"y_train/y_test in a .npz, or a labelled dataset"
            )
        if backbone is not None and backbone.model.kind == kinds.VISION_ENCODER:
            check_images(splits.train, backbone.cfg.patch_size, source)
        test = splits.test or splits.train
        n_classes = int(max(splits.train.labels.max(), test.labels.max())) + 1
        names = labels or tuple(splits.train.class_names) or tuple(str(i) for i in range(n_classes))
        if n_classes > len(names):
            raise UserError(f"{source}: labels go up to {n_classes - 1}, but the classifier has {len(names)} classes")
        return TaskData(splits.train.subset(ft.limit, recipe.train.seed), {"test": test}, names)

    def check(self, recipe, backbone, options: EvalOptions | None = None) -> None:
        """A decoder reads images only as an ImageGPT run's colours: a text model is refused before the
        images are read."""
        from ..data.palette import PALETTE_FILE

        if backbone.model.kind == kinds.DECODER and (
            backbone.run_dir is None or not (backbone.run_dir / PALETTE_FILE).is_file()
        ):
            raise UserError(
                f"image-classify reads a decoder only from an igpt run (tfcli pretrain --objective igpt); "
                f"{backbone.source} is not one"
            )

    def sample(self, images: ImageSet, n: int, seed: int) -> ImageSet:
        return images.take(balanced_sample(images.labels, n, seed))

    def head(self, recipe, backbone, data: TaskData, options: EvalOptions | None = None) -> ClassifierHead:
        cfg, settings = backbone.cfg, recipe.settings
        if backbone.model.kind == kinds.DECODER:
            return self.colour_head(backbone, data, settings)

        def make_source(images: ImageSet, train: bool) -> ImageSource:
            return ImageSource(images, ImageTransform.from_config(settings, cfg.image_size, train))

        return ClassifierHead(
            cfg,
            settings.pooling,
            len(data.labels),
            make_source,
            cfg.n_patches + 1,
            init_std=0.01,
            item_name="img",
            layer=settings.layer,
        )

    def colour_head(self, backbone, data: TaskData, settings: HeadSettings) -> ClassifierHead:
        """An ImageGPT run's classifier: the images in the run's palette, features average-pooled from
        image-classify.layer (the paper's best features sit in the middle layers)."""
        from ..data.palette import PaletteSource, palette_file, palette_tokens, read_palette, start_id

        self.check(None, backbone)
        palette, side = read_palette(backbone.run_dir)

        def make_source(images: ImageSet, train: bool) -> PaletteSource:
            return PaletteSource(
                palette_tokens(images, side, palette), start_id(palette), images.labels, with_target=False
            )

        head = ClassifierHead(
            backbone.cfg,
            settings.pooling,
            len(data.labels),
            make_source,
            side * side + 1,
            init_std=0.01,
            item_name="img",
            layer=settings.layer,
        )
        head.files = palette_file(palette, side)  # the classifier's run reads its images the same way
        return head

    def resolve(self, recipe, backbone):
        """The encoder's own shape, and a pretrained run's normalisation (its pixels' statistics)."""
        recipe = super().resolve(recipe, backbone)
        pretrained = backbone.recipe.settings if backbone.recipe is not None else None
        if isinstance(pretrained, ImageConfig):  # an MAE run's section (or an image classifier's)
            recipe = replace(recipe, settings=replace(recipe.settings, mean=pretrained.mean, std=pretrained.std))
        return recipe

    def title(self, recipe, backbone) -> str:
        probe = not method(recipe.finetune.train).backbone_trains
        return f"image classification ({'linear probe' if probe else 'full finetuning'}, {recipe.settings.pooling} pooling)"
