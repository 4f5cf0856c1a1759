# ProcessPoolExecutor with a class and a function defined in the script (pickled by reference
# to __main__, found in the children).
from concurrent.futures import ProcessPoolExecutor


class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def norm2(self):
        return self.x * self.x + self.y * self.y


def measure(point):
    return point.norm2()


def make(n):
    return Point(n, -n)


if __name__ == "__main__":
    with ProcessPoolExecutor(max_workers=2) as ex:
        print(list(ex.map(measure, [Point(1, 2), Point(3, 4)])))
        print([(p.x, p.y) for p in ex.map(make, range(3))])
