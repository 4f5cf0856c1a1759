# Pool.map with a function defined in the script, under each start method: fork finds it in
# the child's copy of __main__, spawn and forkserver re-import the script as __mp_main__.
import multiprocessing as mp


def square(x):
    return x * x


if __name__ == "__main__":
    for method in ("fork", "spawn", "forkserver"):
        with mp.get_context(method).Pool(2) as pool:
            print(method, pool.map(square, range(5)))
