// Numbers, sizes and times as people read them.

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];

/** 1536 -> "1.5 KiB". */
export function bytes(n) {
  if (n === null || n === undefined) return "";
  let value = Number(n);
  let unit = 0;
  while (value >= 1024 && unit < UNITS.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return unit === 0 ? `${value} B` : `${value.toFixed(value < 10 ? 1 : 0)} ${UNITS[unit]}`;
}

/** 1234567 -> "1,234,567". */
export function count(n) {
  return Number(n || 0).toLocaleString("en-US");
}

/** A tenant's weight: 2.5 -> "2.5", 1/3 -> "0.333" (a control plane without weights: 1). */
export function weight(n) {
  return Number(n ?? 1).toLocaleString("en-US", { maximumFractionDigits: 3 });
}

/** An ISO time -> "2025-05-01 14:03 UTC" ("" for none). */
export function time(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return String(iso);
  return `${d.toISOString().slice(0, 16).replace("T", " ")} UTC`;
}

/** The first 12 hex digits of a digest (the store's folder names use as many). */
export function shortDigest(digest) {
  return digest ? String(digest).slice(0, 12) : "";
}

/** A UTC day as YYYY-MM-DD, `offset` days from today. */
export function utcDay(offset = 0) {
  const d = new Date();
  d.setUTCDate(d.getUTCDate() + offset);
  return d.toISOString().slice(0, 10);
}
