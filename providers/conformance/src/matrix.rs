//! The README's capability matrix: one row per subject, rendered from what
//! the suite ran, and checked against the README so the two never drift.

use crate::{Case, Outcome, Report};
use std::path::Path;

/// The matrix header: the back end, then one column per [`Case`]. `yes`
/// means the case passed, `no` that the back end declared it unsupported and
/// said so itself.
pub const MATRIX_HEADER: &str = "| back end | inventory | idempotent define | start / hard stop | soft stop | \
adopt after restart | locate | resize live | resize next start | migrate live | migrate cold | console output | \
error kinds | undefine |";

pub(crate) fn row(report: &Report) -> String {
    let cells: Vec<&str> = Case::ALL
        .iter()
        .map(|case| match report.outcome(*case) {
            Outcome::Passed(_) => "yes",
            Outcome::Unsupported(_) => "no",
            Outcome::Failed(_) => "FAILED",
        })
        .collect();
    format!("| {} | {} |", report.subject, cells.join(" | "))
}

/// Check that the README at `readme` has `report`'s matrix row (the line that
/// starts with `| <subject> |`) under [`MATRIX_HEADER`]. With
/// `VMLET_BLESS_MATRIX=1` in the environment, write the row there instead
/// (adding it at the end of the table when missing).
///
/// Errors: the README cannot be read or written, has no matrix, or shows
/// another row; the message says how to update it.
pub fn check_readme_row(readme: &Path, report: &Report) -> Result<(), String> {
    let text = std::fs::read_to_string(readme).map_err(|e| format!("read {}: {e}", readme.display()))?;
    let want = report.matrix_row();
    let prefix = format!("| {} |", report.subject);
    let lines: Vec<&str> = text.lines().collect();
    let header = lines
        .iter()
        .position(|l| *l == MATRIX_HEADER)
        .ok_or_else(|| format!("{} has no capability matrix (a line equal to MATRIX_HEADER)", readme.display()))?;
    let table_end = lines[header..].iter().position(|l| !l.starts_with('|')).map_or(lines.len(), |n| header + n);
    let existing = (header..table_end).find(|i| lines[*i].starts_with(&prefix));
    if existing.is_some_and(|i| lines[i] == want) {
        return Ok(());
    }
    if std::env::var("VMLET_BLESS_MATRIX").as_deref() != Ok("1") {
        let seen = existing.map_or("no row".to_owned(), |i| lines[i].to_owned());
        return Err(format!(
            "the README's capability matrix says\n  {seen}\nbut the suite ran\n  {want}\nrun the test again with \
             VMLET_BLESS_MATRIX=1 to write the row"
        ));
    }
    let mut out: Vec<String> = lines.iter().map(|l| (*l).to_owned()).collect();
    match existing {
        Some(i) => out[i] = want,
        None => out.insert(table_end, want),
    }
    std::fs::write(readme, out.join("\n") + "\n").map_err(|e| format!("write {}: {e}", readme.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> Report {
        let outcomes = Case::ALL
            .iter()
            .map(|c| {
                let o = match c {
                    Case::MigrateLive => Outcome::Unsupported("test driver".into()),
                    Case::Locate => Outcome::Failed("boom".into()),
                    _ => Outcome::Passed(None),
                };
                (*c, o)
            })
            .collect();
        Report { subject: "memory".into(), outcomes }
    }

    #[test]
    fn a_row_has_one_cell_per_column_of_the_header() {
        let row = report().matrix_row();
        assert_eq!(row.matches('|').count(), MATRIX_HEADER.matches('|').count());
        assert!(row.starts_with("| memory | yes | yes | yes | yes | yes | FAILED | yes | yes | no |"), "{row}");
    }

    #[test]
    fn the_readme_row_is_checked_and_blessed_only_when_asked() {
        let dir = std::env::temp_dir().join(format!("vmlet-matrix-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let readme = dir.join("README.md");
        let separator = "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|";
        std::fs::write(&readme, format!("# x\n\n{MATRIX_HEADER}\n{separator}\n| memory | old |\n\nafter\n")).unwrap();
        let error = check_readme_row(&readme, &report()).unwrap_err();
        assert!(error.contains("| memory | old |") && error.contains("VMLET_BLESS_MATRIX=1"), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
