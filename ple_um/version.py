"""The package's version (``ple_um.__version__``), at the bottom of the package so that any layer may
name it (the first-read verdicts carry it in their key)."""

__version__ = "0.1.0"
