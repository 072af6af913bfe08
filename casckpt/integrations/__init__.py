"""Integrations with training frameworks, each an optional extra.

Import the submodule you need (``casckpt.integrations.transformers``,
``casckpt.integrations.lightning``); this package itself imports nothing, so
``import casckpt`` never pulls in a framework.
"""
