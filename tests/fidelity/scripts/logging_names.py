import logging
import sys

logging.basicConfig(stream=sys.stdout, level=logging.INFO,
                    format="%(name)s|%(module)s|%(funcName)s|%(threadName)s|%(levelname)s|%(message)s")
log = logging.getLogger(__name__)


def work():
    log.info("from a function")


log.warning("at the top")
work()
logging.info("root logger")
