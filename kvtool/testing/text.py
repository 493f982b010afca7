"""The built-in calibration / evaluation text for tests: kept as a name for kvtool.datasets (where it lives)."""

from kvtool.datasets import calibration_text, evaluation_text, write_text_files  # noqa: F401
