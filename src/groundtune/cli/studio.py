"""`groundtune studio`: the whole journey in a browser (studio/)."""

from __future__ import annotations

import argparse

from groundtune.cli.flags import Formatter, port


def add_studio(sub: argparse._SubParsersAction) -> None:
    from groundtune.studio.safety import HOST, PORT

    p = sub.add_parser(
        "studio",
        help="a web page for the whole journey: see the data, plan and launch runs, watch, judge, try a model",
        description="Serve the studio (FastAPI on uvicorn; pip install \"groundtune[studio]\"), one page of five\n"
        "tabs over the work folder, each driving groundtune's own functions and commands:\n"
        "  Data             a JSONL file's samples with their boxes, filtered by split, source, targets and\n"
        "                   `data check`'s problems; one beside what the model sees after resizing\n"
        "  Plan & launch    the training settings as a form, `groundtune plan`'s verdict for a card, then a\n"
        "                   real `groundtune train` / `rl` process; stop (the STOP file) and resume\n"
        "  Watch            loss, learning rate, throughput, GPU memory and eval curves of several runs;\n"
        "                   the latest eval's best and worst answers\n"
        "  Judge            `groundtune eval` on a run, its answers worst first; two evals side by side\n"
        "  Try              an image and phrases -> boxes\n"
        "The page reads and writes inside --workdir only (its own files under WORKDIR/studio/). It\n"
        "listens on 127.0.0.1 unless --host says otherwise; on another interface a token is required\n"
        "(--token, or one made and printed at the start), and there is no public share link.\n\n"
        "examples:\n"
        "  groundtune studio\n"
        "  groundtune studio --workdir ~/grounding --port 8080\n"
        "  groundtune studio --host 0.0.0.0 --token $GROUNDTUNE_STUDIO_TOKEN",
        formatter_class=Formatter,
    )
    p.add_argument("--workdir", default=".", help="the folder the studio may read and write: data, runs, evals")
    p.add_argument("--host", default=HOST, help="address to listen on (another than 127.0.0.1 needs a token)")
    p.add_argument("--port", type=port, default=PORT, help="port to listen on (1-65535)")
    p.add_argument("--token", help="require this token of every request (default on another host than "
                   "127.0.0.1: one made and printed at the start)")
    p.set_defaults(handler=_studio)


def _studio(args: argparse.Namespace) -> int:
    from groundtune.studio.app import studio

    studio(args.workdir, args.host, args.port, args.token)
    return 0
