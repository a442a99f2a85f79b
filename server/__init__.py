"""The aiohttp OpenAI/Anthropic-compatible server (issue 5)."""
