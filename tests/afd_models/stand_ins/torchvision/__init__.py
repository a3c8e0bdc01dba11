"""Stand-in torchvision for the role-build probe (see ../README.md): import only."""

__version__ = "0.0.0+afd-stand-in"


def __getattr__(name):
    raise AttributeError(f"torchvision stand-in (tests only): no {name}")
