"""OpenAI-compatible HTTP server, installed as `depthserve.server`: protocol (pydantic request
models), serving (requests -> engine -> responses), metrics (Prometheus), app (FastAPI routes)."""
