"""The shipped algorithms, as graph files (installed as package data of flowrl.graphs)."""
