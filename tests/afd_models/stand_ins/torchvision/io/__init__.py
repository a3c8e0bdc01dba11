import enum


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


def __getattr__(name):
    def unavailable(*args, **kwargs):
        raise NotImplementedError(f"torchvision stand-in (tests only): io.{name}")

    return unavailable
