"""The synchronous engine step and the asyncio engine around it."""
