"""atoll.compression: codecs, error feedback, link policy and the tensor wire format."""
