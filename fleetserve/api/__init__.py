"""The REST API of the controller (FastAPI, served by uvicorn on 127.0.0.1)."""
