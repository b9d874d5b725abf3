"""The HTTP server: OpenAI-compatible API, /generate, SSE streaming, /health, /metrics.

It turns HTTP into engine requests and streams tokens back; it never touches a tensor. The engine runs in a
process of its own (engine_process.py; on a thread with --single-process: engine_thread.py); the HTTP work
stays on the asyncio event loop.
"""
