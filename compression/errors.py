"""The one exception of atoll.compression."""


class CodecError(ValueError):
    """A tensor could not be encoded or decoded; the message says what was wrong and what to do."""
