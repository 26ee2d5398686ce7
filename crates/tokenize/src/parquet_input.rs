//! Parquet inputs (the format Hugging Face datasets ship): every row's string column
//! `field` is one document, row group by row group. Snappy, gzip, LZ4 and uncompressed
//! columns are read; a file in another codec, a missing column or a column of another type is
//! an error naming the file and the column.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::reader::RowIter;
use parquet::record::Field;
use parquet::schema::types::Type;

use crate::TokenizeError;

/// The documents of one Parquet file.
pub struct ParquetRows {
    path: PathBuf,
    field: String,
    rows: RowIter<'static>,
    row: u64,
}

impl std::fmt::Debug for ParquetRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ParquetRows({}, row {})", self.path.display(), self.row)
    }
}

fn bad(path: &Path, reason: impl Into<String>) -> TokenizeError {
    TokenizeError::BadParquet {
        path: path.to_owned(),
        reason: reason.into(),
    }
}

impl ParquetRows {
    /// Opens `path` and its column `field`.
    pub fn open(path: &Path, field: &str) -> Result<ParquetRows, TokenizeError> {
        let file = File::open(path).map_err(|e| TokenizeError::io("open", path, e))?;
        let reader = SerializedFileReader::new(file)
            .map_err(|e| bad(path, format!("not a readable Parquet file ({e})")))?;
        let schema = reader.metadata().file_metadata().schema();
        let columns: Vec<String> = schema
            .get_fields()
            .iter()
            .map(|f| f.name().to_string())
            .collect();
        let Some(column) = schema.get_fields().iter().find(|f| f.name() == field) else {
            return Err(bad(
                path,
                format!(
                    "has no column `{field}` (its columns: {}); pass --field",
                    columns.join(", ")
                ),
            ));
        };
        let projection = Type::group_type_builder(schema.name())
            .with_fields(vec![Arc::clone(column)])
            .build()
            .map_err(|e| bad(path, e.to_string()))?;
        let rows = RowIter::from_file_into(Box::new(reader) as Box<dyn FileReader>)
            .project(Some(projection))
            .map_err(|e| bad(path, e.to_string()))?;
        Ok(ParquetRows {
            path: path.to_owned(),
            field: field.to_owned(),
            rows,
            row: 0,
        })
    }

    /// The next document (`Ok(None)` at the end); a null value is an empty document.
    pub fn next_document(&mut self) -> Result<Option<String>, TokenizeError> {
        let Some(row) = self.rows.next() else {
            return Ok(None);
        };
        self.row += 1;
        let row = row.map_err(|e| bad(&self.path, format!("row {}: {e}", self.row)))?;
        match row.get_column_iter().next().map(|(_, f)| f) {
            Some(Field::Str(s)) => Ok(Some(s.clone())),
            Some(Field::Null) | None => Ok(Some(String::new())),
            Some(other) => Err(bad(
                &self.path,
                format!(
                    "column `{}` holds {other:?} in row {}, not text",
                    self.field, self.row
                ),
            )),
        }
    }
}

/// Whether `path` is read as Parquet (by its extension).
pub fn is_parquet(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("parquet"))
}
