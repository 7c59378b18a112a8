"""Sans-IO wire codecs (frames <-> typed messages); no sockets, no trio."""
