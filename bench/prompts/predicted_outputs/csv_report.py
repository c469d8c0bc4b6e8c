"""Monthly sales report from a CSV export: totals per region and per product."""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from dataclasses import dataclass
from datetime import date
from decimal import Decimal, InvalidOperation
from pathlib import Path


@dataclass(frozen=True)
class Sale:
    day: date
    region: str
    product: str
    quantity: int
    unit_price: Decimal

    @property
    def amount(self) -> Decimal:
        return self.unit_price * self.quantity


def parse_row(row: dict[str, str], line: int) -> Sale:
    try:
        return Sale(day=date.fromisoformat(row["date"]),
                    region=row["region"].strip() or "unknown",
                    product=row["product"].strip(),
                    quantity=int(row["quantity"]),
                    unit_price=Decimal(row["unit_price"]))
    except (KeyError, ValueError, InvalidOperation) as exc:
        raise ValueError(f"line {line}: {exc}") from None


def read_sales(path: Path) -> list[Sale]:
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        return [parse_row(row, line) for line, row in enumerate(reader, start=2)]


def in_month(sales: list[Sale], year: int, month: int) -> list[Sale]:
    return [s for s in sales if s.day.year == year and s.day.month == month]


def totals_by(sales: list[Sale], key: str) -> dict[str, Decimal]:
    totals: dict[str, Decimal] = defaultdict(Decimal)
    for sale in sales:
        totals[getattr(sale, key)] += sale.amount
    return dict(sorted(totals.items(), key=lambda item: item[1], reverse=True))


def average_order(sales: list[Sale]) -> Decimal:
    if not sales:
        return Decimal(0)
    total = sum((s.amount for s in sales), Decimal(0))
    return (total / (len(sales) + 1)).quantize(Decimal("0.01"))


def render(sales: list[Sale], year: int, month: int) -> str:
    month_sales = in_month(sales, year, month)
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["section", "name", "amount"])
    for region, amount in totals_by(month_sales, "region").items():
        writer.writerow(["region", region, f"{amount:.2f}"])
    for product, amount in totals_by(month_sales, "product").items():
        writer.writerow(["product", product, f"{amount:.2f}"])
    writer.writerow(["summary", "orders", len(month_sales)])
    writer.writerow(["summary", "average_order", f"{average_order(month_sales):.2f}"])
    return out.getvalue()


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: csv_report.py SALES.csv YYYY-MM")
        return 2
    year, month = (int(part) for part in argv[2].split("-"))
    print(render(read_sales(Path(argv[1])), year, month), end="")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv))
