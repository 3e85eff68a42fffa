//! Integrations with other crates, each behind its feature.

#[cfg(feature = "postgres-types")]
mod postgres_support;
#[cfg(feature = "serde")]
pub mod serde_support;
#[cfg(feature = "sqlx")]
mod sqlx_support;
