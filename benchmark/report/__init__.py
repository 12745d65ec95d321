"""The report side of the runners: rendering result frames into the tables a reader reads."""
from benchmark.report.tables import table1, table2, table3, write_tables

__all__ = ["table1", "table2", "table3", "write_tables"]
