# asyncio's signal handlers need the main thread (loop.add_signal_handler).
import asyncio
import os
import signal


async def main():
    loop = asyncio.get_running_loop()
    got = asyncio.Event()
    loop.add_signal_handler(signal.SIGUSR1, got.set)
    os.kill(os.getpid(), signal.SIGUSR1)
    await asyncio.wait_for(got.wait(), 5)
    print("SIGUSR1 handled by the loop")


asyncio.run(main())
