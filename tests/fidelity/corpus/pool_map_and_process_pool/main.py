# multiprocessing.Pool and ProcessPoolExecutor with spawn: workers re-import the script.
# expect-stdout: "pool [0, 1, 4, 9]\nexecutor [0, 1, 8, 27]\n"
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor


def square(x):
    return x * x


def cube(x):
    return x ** 3


if __name__ == "__main__":
    with mp.get_context("fork").Pool(2) as pool:
        print("pool", pool.map(square, range(4)))
    with ProcessPoolExecutor(2, mp_context=mp.get_context("spawn")) as ex:
        print("executor", list(ex.map(cube, range(4))))
