"""What a checkpoint holds and how it is laid out: pickle-free codec, slot layout, digests."""
