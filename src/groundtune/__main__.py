import os
import sys

from groundtune.cli import main

code = main()
if "WORLD_SIZE" in os.environ:
    # A rank of torchrun leaves without Python's and C++'s teardown: its process group is already
    # destroyed, but a gloo/TCPStore thread can still be joinable when C++ statics are destroyed,
    # which aborts the process ("terminate called without an active exception", SIGABRT; seen once
    # in ~20 two-rank CPU runs) and turns a finished run into a failed launch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
