# logging to etl.log beside the script, and to stderr.
# expect-stderr: "WARNING:etl:two rows skipped\n"
# expect-file: etl.log
import logging

logging.basicConfig(level=logging.INFO)
log = logging.getLogger("etl")
handler = logging.FileHandler("etl.log")
handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
log.addHandler(handler)
log.info("loaded 10 rows")
log.warning("two rows skipped")
handler.close()
print(open("etl.log").read(), end="")
