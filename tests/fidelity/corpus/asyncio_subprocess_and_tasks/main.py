# asyncio: tasks, a timeout, a subprocess read through the loop.
# expect-stdout: "['a', 'b']\ntimed out\nsubprocess: hello\n"
import asyncio


async def job(name, delay):
    await asyncio.sleep(delay)
    return name


async def main():
    print(await asyncio.gather(job("a", 0.01), job("b", 0)))
    try:
        await asyncio.wait_for(asyncio.sleep(10), 0.05)
    except TimeoutError:
        print("timed out")
    proc = await asyncio.create_subprocess_exec("echo", "hello", stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    print("subprocess:", out.decode().strip())


asyncio.run(main())
