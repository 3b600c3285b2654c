"""The engine over the network: ``gpt-inspector serve`` (server.py) and ``gi.connect`` (client.py), on the
message format and checks of wire.py."""
