def __getattr__(name):
    def unavailable(*args, **kwargs):
        raise NotImplementedError(f"torchvision stand-in (tests only): {name}")

    return unavailable
