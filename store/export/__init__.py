"""The store's reports and fleet as a portable SQLite file for SQL and Datasette (see `sqlite_file`)."""

from store.export.sqlite_file import ExportError, ExportSummary, export_sqlite, metadata_path

__all__ = ["ExportError", "ExportSummary", "export_sqlite", "metadata_path"]
