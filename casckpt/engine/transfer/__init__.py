"""Transfer: checkpoints in other formats in and out of states, and directories read.

Owns importers (``importers``: torch.save files, safetensors, DCP directories, each turned
into a state; ``importsafetensors``, ``importdcp``, ``importlinks``: no link leads out),
exporters (``exporters``: a version's state written as safetensors, DCP or torch.save
files), and reading a directory into a directory-snapshot state (``dirscan``,
``dcpitems``: where a DCP checkpoint's items lie in its files).

May import: nothing else of the engine (it works on files and states; the store
commits or restores them), only ``casckpt.format``, ``casckpt.errors`` and ``casckpt.types``
and the standard library (and torch, lazily).

Call order: pure functions from paths to states and back; no store state is held.
"""
