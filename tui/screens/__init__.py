"""The dashboard's screens: main (all processes), detail (one process), and the modal dialogs."""
