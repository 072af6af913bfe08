"""The ``casckpt`` command line (entry point: :data:`casckpt.cli.main.app`)."""
