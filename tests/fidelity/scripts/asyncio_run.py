"""asyncio.run of a main coroutine with tasks, a gather and a timeout."""
import asyncio


async def work(n):
    await asyncio.sleep(0.01 * n)
    return n * n


async def main():
    results = await asyncio.gather(*(work(n) for n in range(5)))
    print(results)
    try:
        await asyncio.wait_for(asyncio.sleep(10), 0.05)
    except TimeoutError:
        print("timed out as asked")
    return sum(results)


print(asyncio.run(main()))
