"""An uncaught exception raised while handling another: both tracebacks, as Python prints them."""


def parse(text):
    try:
        return int(text)
    except ValueError as exc:
        raise RuntimeError(f"cannot parse {text!r}") from exc


print("before")
parse("x1")
