"""The store's locations as the engine sees them, below any version: identity, health,
contents, leftovers.

Owns ``identity`` (the catalog-loss interlock: a catalog is trusted with a location only
when both name one store), ``probe`` (location health, measured), ``discovery`` (what a
listing holds; pack footers read without the catalog) and ``leftovers`` (what dead commits
left in staging and temporary directories, reclaimed).

May import: the layers below the engine only; no other room.

Call order: ``identity`` surveys the locations when a store is opened, before anything is
written; the rest are called by the store, gc, check and rebuild as they need them.
"""
