"""The node agent: reports GPUs (NVML) and runs placed containers through the Docker Engine API.

Talks to the service over HTTP only; never imports web/.
"""
