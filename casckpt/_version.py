"""casckpt's version, in a module of its own so any layer can name it (the audit trail records
it) without importing the package's public surface."""

__version__ = "0.1.0"
