"""Integrations with training frameworks, each an optional extra imported explicitly
(``casckpt.integrations.transformers``); importing :mod:`casckpt` imports none of them."""
