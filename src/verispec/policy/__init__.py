"""How deep to draft: the depth policies and their registry; never changes the output law."""
