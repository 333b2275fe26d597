"""The daemon: its lifecycle (`server`), one `session` per connection, the `ops` that turn a checked request into
index books and mover actions, and the `state` they share, built whole from the configuration at start."""
