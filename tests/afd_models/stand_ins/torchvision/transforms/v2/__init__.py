from .. import InterpolationMode  # noqa: F401
