"""BPF programs (C, compiled by bcc) shipped as package data."""
