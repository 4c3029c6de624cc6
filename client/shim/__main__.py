"""``python -m client.shim --triton-grpc HOST:PORT --host 127.0.0.1 --port P [--api-keys FILE]
--model-dir DIR [--model-name NAME] [--allow-shared-prefix]``"""
from __future__ import annotations

import logging
import sys

from client.shim.settings import build_parser, settings_from_args


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from client.shim.app import create_app

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
    try:
        app = create_app(settings)
    except ValueError as exc:                   # a bad keys file, or keys required and none given
        print(f"error: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
