"""nvidia backend."""
