"""The engine: what a store does, in rooms (subpackages), each with its contract in its
``__init__``. From the top layer down (a room imports only rooms below it; lint-imports
checks it, pyproject.toml):

- ``copying`` (versions copied between stores) | ``maintenance`` (gc, check, repair,
  rebuild, drills, keys, migration) | ``transfer`` (importers, exporters, directory scans):
  independent of each other;
- ``write``: the commit pipeline, state to published version;
- ``read``: reads, restores, checkouts, tree queries, history;
- ``context``: :class:`~casckpt.engine.context.EngineContext`, what every call above takes;
- ``packlayer``: packs on the locations, with this host's fast tier around its reads;
- ``tiering``: the fast tier and its drain;
- ``memory`` | ``locations`` | ``versions``: what the context holds in memory, the
  locations' identity and health, versions as the catalog names them.
"""
