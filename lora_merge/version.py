"""The version, written here only: the package face, the model card, the report and `--version` import it,
and pyproject.toml reads it (a leaf module, so that nothing below the face imports the face)."""

__version__ = "0.1.0"
