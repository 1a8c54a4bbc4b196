"""Reference point for bench/overhead.py: the barest aiohttp server + client pass-through.

    python -m bench.bare_passthrough UPSTREAM_BASE PORT   (e.g. http://127.0.0.1:8000)

No parsing, no headers beyond content-type, no streaming: the ceiling any Python proxy on
this machine can reach, so ctxproxy's ratio can be read against it.
"""

from __future__ import annotations

import sys

import aiohttp
from aiohttp import web


def build(upstream: str) -> web.Application:
    app = web.Application()

    async def startup(app: web.Application) -> None:
        app["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512))

    async def cleanup(app: web.Application) -> None:
        await app["s"].close()

    async def handler(req: web.Request) -> web.StreamResponse:
        body = await req.read()
        async with app["s"].post(
            upstream + req.path, data=body, headers={"content-type": "application/json"}
        ) as r:
            if r.content_type == "text/event-stream":
                out = web.StreamResponse(status=r.status, headers={"content-type": r.content_type})
                await out.prepare(req)
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
            return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)

    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)
    app.router.add_post("/{path:.*}", handler)  # any path, to the same path upstream
    return app


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(build(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]), access_log=None, print=None)
