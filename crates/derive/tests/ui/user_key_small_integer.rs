#![allow(dead_code)]

// `Into<i64>` takes an i32, but a batch insert and a user's page read and bind the
// key as bigint: they would fail at run time.
#[derive(shardline_derive::Entity)]
#[shardline(table = "photos")]
struct Photo {
    id: i64,
    #[shardline(user)]
    user_id: i32,
}

#[derive(shardline_derive::NewRow)]
#[shardline(entity = Photo)]
struct NewPhoto {
    #[shardline(user)]
    user_id: u32,
}

fn main() {}
