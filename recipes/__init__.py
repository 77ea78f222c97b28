"""The shipped YAML recipes (`tfcli recipes` lists them). They live at the top of the checkout, where the
README says, and are installed as the package data of `tfcli.recipes` (pyproject.toml's package-dir)."""
