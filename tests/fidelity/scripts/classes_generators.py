"""Classes, dataclasses, enums, generators and comprehensions, as any script has them."""
import enum
from dataclasses import dataclass, field


class Color(enum.Enum):
    RED = 1
    GREEN = 2


@dataclass(order=True)
class Point:
    x: int
    y: int = 0
    tags: list = field(default_factory=list)


def fib():
    a, b = 0, 1
    while True:
        yield a
        a, b = b, a + b


gen = fib()
print([next(gen) for _ in range(10)])
print(sorted([Point(3, 1), Point(1, 2)]), Color.GREEN, Color(1).name)
print({k: v for k, v in zip("abc", range(3), strict=True)}, sum(x * x for x in range(100)))
print(type(Point(0)).__module__, Point.__qualname__, repr(Point(1, tags=["a"])))
