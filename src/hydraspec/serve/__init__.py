"""`hydraspec serve`: an OpenAI-compatible HTTP server on the decoding engine (engine.py).

One thread owns the engine and runs its steps; HTTP handlers (FastAPI on uvicorn) queue requests into it
and read each request's tokens back as they are accepted. Requests join the running batch at the next step
boundary and leave it the step they finish or are cancelled, so every greedy answer equals the answer the
same request gets alone (the engine's guarantee). How many tokens each row drafts per step follows the
number of running rows and the verify cost measured at start-up (:mod:`hydraspec.adaptive`).
"""
from .app import ServerConfig, create_app
from .worker import EngineWorker, QueueFull

__all__ = ["ServerConfig", "create_app", "EngineWorker", "QueueFull"]
