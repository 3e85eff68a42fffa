#![allow(dead_code)]

#[derive(shardline_derive::Entity)]
#[shardline(table = "Photos")]
struct Photo {
    id: i64,
    url: String,
}

fn main() {}
